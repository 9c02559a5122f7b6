"""kproxy membership package."""
