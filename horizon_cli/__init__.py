"""horizon: fine-tune LLMs with host RAM as the parameter store and the GPU as a streaming engine."""

from .quiet import silence_import_noise

__version__ = "0.1.0"

silence_import_noise()  # before anything imports transformers (and, through it, torchao)
