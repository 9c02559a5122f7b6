"""kproxy chaos package."""
