"""[models]: the model providers and models a box may call, the mode (live, record, replay) and the run's budgets;
and the decision on one model call (doors/model.py states the request and the run's totals)."""

from __future__ import annotations

import fnmatch
import re
from typing import Any

from tkbox_nb.core.errors import PolicyError
from tkbox_nb.policy.base import MAX_LIST, Settings, Verdict, seconds_problem, tname
from tkbox_nb.policy.model_fetches import SERVER_TOOLS, decide_fetches

MODEL_MODES = ("live", "record", "replay")
MODEL_PROVIDERS = ("openai", "anthropic")
# [models] keys: mode, allow, budgets (each per run, except the *_per_call and max_request_bytes ones), timeout
MODEL_KEYS: dict[str, type | tuple[type, ...]] = {
    "mode": str, "allow": list, "max_calls": int, "max_input_tokens": int, "max_output_tokens": int,
    "max_output_tokens_per_call": int, "max_request_bytes": int, "timeout_s": (int, float), "server_tools": str}
MODEL_DEFAULTS: dict[str, Any] = {"mode": "live", "allow": [], "max_calls": 0, "max_input_tokens": 0,
                                  "max_output_tokens": 0, "max_output_tokens_per_call": 0,
                                  "max_request_bytes": 4 << 20, "timeout_s": 120, "server_tools": "refuse"}
MAX_REQUEST_BYTES = 16 << 20  # the door's own ceiling on one request body, whatever the policy says
PROVIDER_KEYS: dict[str, type] = {"base_url": str, "key": str, "secret": str}
PROVIDER_URLS = {"openai": "https://api.openai.com", "anthropic": "https://api.anthropic.com"}


def validate(models: Any, name: str, secrets: dict[str, Any]) -> dict[str, Any]:
    """[models] (mode, allow, budgets) and one [models.PROVIDER] table per provider a call may go to."""
    if not isinstance(models, dict):
        raise PolicyError(f"{name}: [models] must be a table")
    out: dict[str, Any] = {"providers": {}}
    for key, value in models.items():
        where = f"{name}: models.{key}"
        if key in MODEL_PROVIDERS:
            out["providers"][key] = validate_provider(value, where, secrets)
            continue
        if key not in MODEL_KEYS:
            raise PolicyError(f"{where}: unknown key (known: {', '.join(sorted(MODEL_KEYS))}, and the provider "
                              f"tables {', '.join(MODEL_PROVIDERS)})")
        want = MODEL_KEYS[key]
        if isinstance(value, bool) or not isinstance(value, want):
            raise PolicyError(f"{where} must be {tname(want)}")
        if key == "mode" and value not in MODEL_MODES:
            raise PolicyError(f"{where} must be one of {', '.join(MODEL_MODES)}, not {value!r}")
        if key == "server_tools" and value not in SERVER_TOOLS:
            raise PolicyError(f"{where} must be one of {', '.join(SERVER_TOOLS)}, not {value!r}")
        if key == "allow":
            for pattern in value:
                provider, sep, model = pattern.partition(":") if isinstance(pattern, str) else ("", "", "")
                if not sep or not model or provider not in MODEL_PROVIDERS or len(pattern) > 200:
                    raise PolicyError(f"{where} entry {pattern!r} must be PROVIDER:MODEL (PROVIDER one of "
                                      f"{', '.join(MODEL_PROVIDERS)}; MODEL may use * and ?)")
            if len(value) > MAX_LIST:
                raise PolicyError(f"{where} has more than {MAX_LIST} entries")
        if key.startswith("max_") and value < 0:
            raise PolicyError(f"{where} must be 0 (no limit) or more")
        if key == "max_request_bytes" and not 0 < value <= MAX_REQUEST_BYTES:
            raise PolicyError(f"{where} must be between 1 and {MAX_REQUEST_BYTES}")
        if key == "timeout_s" and seconds_problem(value, 3600):
            raise PolicyError(f"{where} {seconds_problem(value, 3600)}")
        out[key] = value
    if out.get("mode") != "replay":
        for provider in out["providers"].values():
            if "key" not in provider and "secret" not in provider:
                raise PolicyError(f"{name}: models.{provider['name']} needs key = \"env:VAR\" (or file:PATH) or "
                                  "secret = \"NAME\" of a [secrets.NAME] binding")
    return out


def validate_provider(body: Any, where: str, secrets: dict[str, Any]) -> dict[str, Any]:
    from urllib.parse import urlsplit
    if not isinstance(body, dict):
        raise PolicyError(f"{where} must be a table")
    for key, value in body.items():
        if key not in PROVIDER_KEYS:
            raise PolicyError(f"{where}: unknown key {key} (known: {', '.join(sorted(PROVIDER_KEYS))})")
        if not isinstance(value, str) or not value or "\x00" in value:
            raise PolicyError(f"{where}.{key} must be a non-empty string")
    provider = where.rsplit(".", 1)[1]
    url = body.get("base_url", PROVIDER_URLS[provider]).rstrip("/")
    try:
        parts = urlsplit(url)
        parts.port
    except ValueError:
        raise PolicyError(f"{where}.base_url {url!r} is not a URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment \
            or "@" in parts.netloc:
        raise PolicyError(f"{where}.base_url must be http(s)://HOST[:PORT][/PATH], without user, query or fragment")
    if "key" in body and "secret" in body:
        raise PolicyError(f"{where}: give key or secret, not both")
    if "key" in body and not re.fullmatch(r"(env:[A-Za-z_][A-Za-z0-9_]*|file:.+)", body["key"]):
        raise PolicyError(f"{where}.key must be env:VAR or file:PATH (where the host reads the key; never the key)")
    if "secret" in body and body["secret"] not in secrets:
        raise PolicyError(f"{where}.secret names {body['secret']!r}, which is not a [secrets.NAME] binding here")
    return {"name": provider, **body, "base_url": url}


def setting(policy: Settings, key: str) -> Any:
    """A [models] setting (its default when the policy has no [models] or does not say)."""
    return policy.data.get("models", {}).get(key, MODEL_DEFAULTS[key])


def decide(policy: Settings, kind: Any, facts: dict[str, Any]) -> Verdict:
    """One model call. The facts carry the request as the door parsed it and the run's totals before this call
    (calls decided, tokens reported, output tokens reserved by calls still in flight), so budgets stay pure."""
    if kind != "call":
        return Verdict("deny", "models.kind", f"unknown model kind {kind!r}")
    models = policy.data.get("models")
    if models is None:
        return Verdict("deny", "models.none", "the policy allows no model calls (it has no [models] section)")
    if facts.get("request_error"):
        return Verdict("deny", "models.request", str(facts["request_error"])[:300])
    provider, model = facts.get("provider"), facts.get("model")
    if not (isinstance(provider, str) and isinstance(model, str)):
        return Verdict("deny", "models.request", "a model call that names no provider and model")
    mode, want = facts.get("mode"), setting(policy, "mode")
    if want == "replay" and mode != "replay":
        return Verdict("deny", "models.mode", "[models] mode = \"replay\": calls are served from a bundle's "
                                              "recordings only, never sent upstream")
    if mode not in MODEL_MODES:
        return Verdict("deny", "models.mode", f"unknown mode {mode!r}")
    name = f"{provider}:{model}"
    rule = next((f"models.allow[{i}]" for i, pattern in enumerate(setting(policy, "allow"))
                 if fnmatch.fnmatchcase(name, pattern)), None)
    if rule is None:
        return Verdict("deny", "models.allow", f"{name} is not in [models] allow")
    if mode == "replay" and facts.get("recorded") is not True:
        return Verdict("deny", "models.replay", f"replay: this {name} request was not recorded in the bundle "
                                                "being replayed (or no bundle was given), and replay never "
                                                "calls upstream")
    if mode != "replay" and provider not in models.get("providers", {}):
        return Verdict("deny", "models.provider", f"[models.{provider}] is not configured")
    refused = decide_fetches(policy, facts.get("fetches"))  # server-side tools, MCP servers, URLs the provider fetches
    if refused:
        return refused
    ints = {k: facts.get(k) for k in ("run_calls", "run_input_tokens", "run_output_tokens", "request_size")}
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints.values()):
        return Verdict("deny", "models.request", "a model call without the run's totals")
    asked = facts.get("max_output")
    if asked is not None and not (isinstance(asked, int) and not isinstance(asked, bool) and asked >= 0):
        return Verdict("deny", "models.request", "max output tokens that are not a count")
    if ints["request_size"] > setting(policy, "max_request_bytes"):
        return Verdict("deny", "models.max_request_bytes",
                       f"the request is {ints['request_size']} bytes, over {setting(policy, 'max_request_bytes')}")
    limit = setting(policy, "max_calls")
    if limit and ints["run_calls"] >= limit:
        return Verdict("deny", "models.max_calls", f"the run has made its {limit} model call(s)")
    per_call = setting(policy, "max_output_tokens_per_call")
    if per_call and (asked is None or asked > per_call):
        return Verdict("deny", "models.max_output_tokens_per_call",
                       f"the request must ask for at most {per_call} output tokens (max_tokens), "
                       f"it asks for {'no limit' if asked is None else asked}")
    limit = setting(policy, "max_input_tokens")
    if limit and ints["run_input_tokens"] >= limit:
        return Verdict("deny", "models.max_input_tokens",
                       f"the run has used {ints['run_input_tokens']} of its {limit} input tokens")
    limit = setting(policy, "max_output_tokens")
    if limit and ints["run_output_tokens"] + (asked or 0) > limit:
        return Verdict("deny", "models.max_output_tokens",
                       f"the run has used or reserved {ints['run_output_tokens']} of its {limit} output tokens; "
                       f"this call asks for {asked if asked is not None else 'more'}")
    if limit and asked is None:
        return Verdict("deny", "models.max_output_tokens",
                       "with a run output budget the request must say how many output tokens it may use "
                       "(max_tokens)")
    return Verdict("allow", rule)
