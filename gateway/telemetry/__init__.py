"""What the processes report about themselves: Prometheus metrics and
rate-limited logging. Used by storage, HTTP and the archive workers."""
