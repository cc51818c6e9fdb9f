"""Weight quantization formats the store can hold (NF4), below the store and the engine."""
