"""horizon: fine-tune LLMs with host RAM as the parameter store and the GPU as a streaming engine."""

__version__ = "0.1.0"
