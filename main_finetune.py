"""FixRes-finetune a classifier at the test resolution with DDP (see README). ``python main_finetune.py --help``"""
from fixres_dist.launch import main_finetune

if __name__ == "__main__":
    main_finetune()
