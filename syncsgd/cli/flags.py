"""The one way the `syncsgd` verbs declare a flag, so that every flag takes every spelling.

Caffe's tool spells flags `-solver`; Python users expect `--solver`, and `--resize-height` for a
name Caffe writes `resize_height`. Declaring each flag through `flag` keeps them all alike.
"""


def flag(parser, name, **kwargs):
    """Add `-name`, `--name` and, for a name with underscores, `--name-with-dashes`; the value
    lands in `args.name`."""
    spellings = [f"-{name}", f"--{name}"]
    if "_" in name:
        spellings.append(f"--{name.replace('_', '-')}")
    parser.add_argument(*spellings, dest=name, **kwargs)
