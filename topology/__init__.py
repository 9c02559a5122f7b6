"""kproxy topology package."""
