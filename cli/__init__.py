"""kproxy cli package."""
