"""ftis: collaborative post-training of different LLMs with F-TIS."""

__version__ = "0.1.0"
