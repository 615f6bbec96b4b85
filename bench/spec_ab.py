"""Figure 1's single-stream runs under SpecConfig variants named on the command line, taking
turns in one process (`bench.turns`) beside no-spec: each `--variant NAME:FIELD=VALUE,...`
changes those fields of dynamic K with context drafts at K=7 (figure 1's default variant);
a FIELD with a dot sets that module constant for the variant's turns
(`engine.spec.policy.MARGIN=0.9`). A variant named no_spec_* runs without speculation under
its module constants (only): the token-identity baseline of the variants with the same
constants (`bench.turns`).
Without --variant: fixed K=5 and K=7, dynamic K at most 5 (SpecConfig's own default) and at
most 7, and at most 7 with the dense graph levels, all with context drafts (fixed K=7 ran
best on figure 1 with the 7168-id head; `batch_k=5` ran worst with the head before). Per
run: tok/s, acceptance, token identity with no-spec (and with --traces the dynamic runs' K
picks).

    python -m bench.spec_ab --model M --reps 3 --variant k5:dynamic=False,num_tokens=5 \\
        --out bench/results/profile/spec_ab.json
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from bench.common import eagle, spec_fields
from bench.turns import run_turns, turn_arguments

DEFAULT_VARIANTS = (
    "k5_context:dynamic=False,num_tokens=5",
    "dynamic_k5_context:num_tokens=5",
    "dynamic_k7_context:",
    "dynamic_k7_dense4_context:dense_levels_from=4",
    "k7_context:dynamic=False,num_tokens=7",
)


def parse_variant(text: str) -> tuple[str, dict, dict]:
    """'NAME:FIELD=VALUE,...' as (NAME, SpecConfig fields, module settings): a FIELD with a
    dot is a module constant ('engine.spec.policy.MARGIN=0.9', set before each of the
    variant's turns and put back after, `bench.turns`), any other a SpecConfig field. A bad
    name, field or module constant raises ValueError."""
    from bench.common import parse_setting

    name, sep, rest = text.partition(":")
    name = name.strip()
    if not sep or not name or name == "no_spec":
        raise ValueError(f"{text!r} is not NAME:FIELD=VALUE,... (NAME not 'no_spec')")
    fields, settings = [], {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        if "." not in item.partition("=")[0]:
            fields.append(item)
            continue
        try:
            key, value = parse_setting(item)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"{item!r}: {e}") from None
        settings[key] = value
    return name, spec_fields(",".join(fields)), settings


def variants(args) -> dict:
    base = eagle(args, 7, True, True)
    out = {"no_spec": (None, {})}
    for text in args.variant or DEFAULT_VARIANTS:
        name, fields, settings = parse_variant(text)
        if name in out:
            raise ValueError(f"variant {name!r} named twice")
        if name.startswith("no_spec_"):  # no-spec under module settings: their baseline
            if fields:
                raise ValueError(f"{text!r}: a no-spec variant takes module constants only")
            out[name] = (None, settings)
        else:
            out[name] = (replace(base, **fields), settings)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    turn_arguments(p, "bench/results/profile/spec_ab.json", reps=3)
    p.add_argument("--variant", action="append", default=None, metavar="NAME:FIELD=VALUE,...",
                   help="a variant of dynamic K7 + context: SpecConfig fields, and module "
                        "constants as module.NAME=VALUE (repeatable)")
    p.add_argument("--traces", action="store_true",
                   help="keep every dynamic run's steps and K picks (trace, picks)")
    args = p.parse_args(argv)
    try:
        variants(args)  # refuse bad variants before the model loads
    except ValueError as e:
        p.error(str(e))
    return run_turns("spec_ab", args, variants, traces=args.traces)


if __name__ == "__main__":
    main()
