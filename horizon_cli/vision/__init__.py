"""Vision-language fine-tuning: images through the checkpoint's own processor, its vision tower and
projector on the device, their features merged into the embeddings by transformers' own code,
the language model streamed as ever.

    records   the forms image records come in -> one canonical example (messages, image files)
    encode    the processor: chat template, image-token expansion, pixels; the pixel budget
    imageset  a source's records -> an ImageSet (a TokenSet whose rows carry the image tensors)
    pairs     preference pairs with images (DPO and the other pair losses), as TRL's vision collator
    unpaired  unpaired preference (KTO) examples with images, as TRL's vision KTO collator
    support   which checkpoints train with images, read off transformers' classes; the refusals
    tower     the tower and projector on the device, weights from the store's carried file
    embed     the image merge in front of layer 0, as a wrapper of the engine's embedding stage
    run       what train/ asks: the image data of a store, and the engine's stage for it
"""
