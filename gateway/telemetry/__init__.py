"""What the processes report about themselves: Prometheus metrics and logging
(text or JSON lines, rate-limited where a flood is possible). Used by storage,
HTTP and the archive workers."""
