"""FixRes-finetune a classifier at the test resolution with DDP (see README). ``python main_finetune.py --help``"""
if __name__ == "__main__":
    from fixres_dist import startup

    startup.guard_signals()  # first: Ctrl-C or SIGTERM from here on is one line, not a traceback
    from fixres_dist.entry.scripts import main_finetune

    main_finetune()
