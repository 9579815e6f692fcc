"""`python -m tlt_rt.train.warmup` keeps working: the drafter warm-up lives in train/drafter/warmup.py."""

from tlt_rt.train.drafter.warmup import main

if __name__ == "__main__":
    main()
