"""The command lines' argument parser: errors in one line."""

from __future__ import annotations

import argparse
import difflib


class OneLineParser(argparse.ArgumentParser):
    """Errors in one line (`error: ...`, exit status 2), not the whole usage: a flag the
    command line gets wrong (found while parsing it), with the known flags it is closest
    to and a pointer to `--help`; a value the program refuses after parsing (its own
    `parser.error(...)`), as it is. The trainer's parser, the tools' (`python -m
    train.tools.profile`) and `python -m models.convert`'s."""

    _parsing = False
    # Flags of other programs (HF TrainingArguments' for the trainer) that this one has
    # no use for, each with what to do instead: said in place of a "did you mean".
    explained: dict[str, str] = {}
    # Other programs' names for this one's flags (`--lr`), each with the flag it means.
    aliases: dict[str, str] = {}

    def parse_args(self, args=None, namespace=None):
        self._parsing = True
        try:
            return super().parse_args(args, namespace)
        finally:
            self._parsing = False

    def error(self, message: str):
        if not self._parsing:
            self.exit(2, f"error: {message}\n")
        hint = ""
        if message.startswith("unrecognized arguments:"):
            known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
            unknown = [w.split("=")[0] for w in message.split(":", 1)[1].split()]
            close = {
                w: difflib.get_close_matches(w, known, n=1, cutoff=0.75)
                for w in unknown
                if w.startswith("--")
            }
            for w in close:
                if w in self.aliases:
                    close[w] = [self.aliases[w]]
            hint = "".join(
                f"; {w}: {self.explained[w]}"
                if w in self.explained
                else f"; {w}: did you mean {m[0]}?"
                if m
                else ""
                for w, m in close.items()
            )
        self.exit(2, f"error: {message}{hint} (`{self.prog} --help` lists the flags)\n")
