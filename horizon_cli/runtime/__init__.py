"""Moving bytes and ordering work: events and promises, host <-> device transports (CPU, CUDA),
the weight loader, the device choice, the trace."""
