"""Host-side training state: per unit streaming copy, gradients and optimizer state (full
fine-tuning), the frozen base and the adapters (LoRA), and the CPU AdamW worker that updates them."""
