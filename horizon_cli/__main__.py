"""`python -m horizon_cli ...` is `horizon ...` (torchrun launches it so: `-m horizon_cli train CONFIG`)."""

from .cli import main

if __name__ == "__main__":
    main()
