"""Training DFlash drafters: self-distillation data, the recipe, the loop, the model card."""
