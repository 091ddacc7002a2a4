"""Train an image classifier from scratch with DDP (see README). ``python main_scratch.py --help``"""
if __name__ == "__main__":
    from fixres_dist.cli import main_scratch  # signals guarded and the command line parsed before torch loads

    main_scratch()
