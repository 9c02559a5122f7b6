"""kproxy spark package."""
