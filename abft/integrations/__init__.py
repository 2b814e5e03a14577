"""abft in other frameworks: ``hf`` (the Hugging Face Trainer's callback), ``titan`` (torchtitan's
Trainer, each step replayable), ``dtensor`` (the checked ops' sharding rules for tensor and
sequence parallelism). ``hf`` imports transformers."""
