"""Training drafters: DFlash self-distillation (`adaspec train-dflash`)."""
