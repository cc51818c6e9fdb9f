"""Model math on the device: the functional decoder layer and transformers' own (templates),
attention, masks, MoE router statistics, the loss head, LoRA arithmetic. Weights are arguments."""
