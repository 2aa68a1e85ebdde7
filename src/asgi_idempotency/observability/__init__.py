"""What the guard tells operators: outcomes, metrics, Prometheus, traces, log events."""
