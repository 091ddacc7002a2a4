"""The FixRes method (Touvron et al., NeurIPS 2019): which layers a finetune trains at the test
resolution (``finetuning``), and resolution sweeps with the choice of the best test resolution."""
