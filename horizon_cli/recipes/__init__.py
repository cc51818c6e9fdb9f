"""Training methods, one folder each, plugged into the loop, the dry run and the engine through
the recipe seam (recipe: Recipe, Batches) and chosen once from the config (registry).

    sft          token rows, cross-entropy (the engine's default objective)
    preference   pairs: dpo, cdpo, ipo, simpo, orpo (loss), the reference pass (reference)
    kto          unpaired examples (loss), the preference reference pass
    grpo         online RL on prompts: rewards, advantages, rollouts, log-probs, plan, loss

A recipe owns its objective (engine.seams.LossObjective), its batches, its data's form and the
refusals when data and config disagree, its dry-run plan terms, and its micro-batches' payload
(data.batch.Payload); docs/engine.md walks through adding one.
"""
