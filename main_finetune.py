"""FixRes-finetune a classifier at the test resolution with DDP (see README). ``python main_finetune.py --help``"""
if __name__ == "__main__":
    from fixres_dist import startup

    startup.guard_signals()  # first: Ctrl-C or SIGTERM from here on is one line, not a traceback
    from fixres_dist.cli import main_finetune  # parses the command line before torch loads

    main_finetune()
