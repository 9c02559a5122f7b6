"""kproxy proxy package."""
