"""FixRes-finetune a classifier at the test resolution with DDP (see README). ``python main_finetune.py --help``"""
if __name__ == "__main__":
    from fixres_dist.cli import main_finetune  # signals guarded and the command line parsed before torch loads

    main_finetune()
