"""Online RL (an `rl:` section): GRPO with rollouts from the streamed engine on the current host
weights (docs/rl.md).

    rewards     the reward functions: user "file.py:name" / "module:name" with TRL's calling
                convention, and the built-ins accuracy, format, length; their errors in one line
    advantages  TRL 1.16's group advantages (scale_rewards group | batch | none) and reward metrics
    logps       per-token log-probs of a forward-only sweep (the old policy, the reference)
    rollouts    one step's completions: sampled (generate.decoder), as micro-batches for the loss
                (recipes.grpo.loss), written to <output.dir>/rollouts/step-N.jsonl
    batches     the train loop's strategy for an rl run (GRPOBatches, chosen by recipes.registry through recipe.Grpo)
    loss        the GRPO objective and its payload (GRPOPayload)
    recipe      the recipe: wants an rl: section, reads prompts, plans the rollouts
"""
