"""The box policy (TOML): core.py loads it and validates it strictly, one module per door holds that door's section and
decide function (box, exec, egress, secrets, models, patch, host), and signing/signer.py the [signer] section.

Every name other modules (and older code) import from `tkbox_nb.policy` is here.
"""

from tkbox_nb.core.errors import PolicyError  # noqa: F401
from tkbox_nb.policy.base import MAX_LIST, Settings, Verdict  # noqa: F401
from tkbox_nb.policy.box import BACKENDS, ISOLATION  # noqa: F401
from tkbox_nb.policy.core import _DEFAULTS, _LATER, _SCHEMA, DEFAULT_SOURCE, MAX_POLICY_BYTES, Policy, policy_hash  # noqa: F401
from tkbox_nb.policy.models import (MAX_REQUEST_BYTES, MODEL_DEFAULTS, MODEL_KEYS, MODEL_MODES, MODEL_PROVIDERS,  # noqa: F401
                                    PROVIDER_KEYS, PROVIDER_URLS)
from tkbox_nb.policy.patch import PATCH_APPLY  # noqa: F401
from tkbox_nb.policy.secrets import SECRET_KEYS  # noqa: F401
