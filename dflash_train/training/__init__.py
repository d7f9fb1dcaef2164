"""What trains a drafter: the model, its loss and position weights, the batches read from a cache, the
trainer, its checkpoints, torchrun and FSDP, and the export."""
