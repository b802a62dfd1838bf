"""Errors the user can act on: printed as a message, without a traceback, exit status 2."""


class UserError(Exception):
    """A problem the user can fix; the message says what is wrong and what to do."""


class OutOfMemory(UserError):
    """Training ran out of memory and could not back off any further; `split` is the batch split
    it ran out at."""

    def __init__(self, message: str, split: object = None):
        super().__init__(message)
        self.split = split


def hub_error(name: str, error: OSError, what: str = "model", config_only: bool = False) -> UserError:
    """A hub id that could not be loaded, as a message that says why (the network, the name, or
    a gated repository) and how to use a local folder instead; with `config_only` (its config.json
    was wanted, as planning wants it), that a folder with that file alone is enough to plan."""
    import os

    text = str(error)
    lowered = text.lower()
    if os.path.isdir(os.path.expanduser(name)):  # a local folder: what is wrong is in it, not the network
        first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
        return UserError(f"cannot load the {what} from the folder '{name}': {first}. Is the folder complete "
                         "(every file its index names: a download or copy cut short leaves shards out)?")
    if any(k in lowered for k in ("gated", "401", "403", "restricted", "authenticat")):
        cause = (f"'{name}' is gated or private: accept its licence on huggingface.co, then log in "
                 "(hf auth login, or set HF_TOKEN)")
    elif os.environ.get("HF_HUB_OFFLINE") == "1" or "couldn't connect" in lowered or "connection" in lowered:
        cause = (f"the hub cannot be reached (no network, or HF_HUB_OFFLINE=1) and '{name}' is not in the local "
                 "cache")
    elif any(k in lowered for k in ("not a valid model identifier", "404", "repository not found",
                                   "does not appear to have")):
        cause = f"'{name}' is not on the hub (check the spelling: organisation/name)"
    else:
        cause = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    planning = (" (to plan only, its config.json is enough: hf download {name} config.json --local-dir DIR; "
                "tests/fixtures/model_configs holds some)").format(name=name) if config_only else ""
    return UserError(f"cannot load the {what} '{name}': {cause}. To use a local copy instead: "
                     f"hf download {name} --local-dir DIR, then set model.name_or_path=DIR{planning}")
