"""Train an image classifier from scratch with DDP (see README). ``python main_scratch.py --help``"""
from fixres_dist.launch import main_scratch

if __name__ == "__main__":
    main_scratch()
