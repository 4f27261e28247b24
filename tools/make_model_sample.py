"""Records notebooks/samples/model-calls.tkb: a box whose agent calls an OpenAI-compatible and an Anthropic-compatible
upstream (the test suite's fake upstreams, in a network namespace; needs root), in record mode, signed by the signer
of $TKBOX_HOME, the one notebooks/samples/trust.json pins. Run: TKBOX_HOME=... python tools/make_model_sample.py"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.e2e.test_models import PORT, Upstream  # noqa: E402
from tkbox_nb import Box, Policy  # noqa: E402
from tests.testnet import NamespaceNet  # noqa: E402

AGENT = (ROOT / "notebooks" / "samples" / "model_agent.py").read_text()


def main() -> None:
    os.environ.setdefault("SAMPLE_OPENAI_KEY", "sk-sample-openai-key-never-in-the-box")
    os.environ.setdefault("SAMPLE_ANTHROPIC_KEY", "sk-sample-anthropic-key-never-in-the-box")
    with NamespaceNet(index=17) as net:
        up = Upstream(net)
        try:
            policy = Policy.from_toml(f"""
[models]
mode = "record"
allow = ["openai:gpt-4o-mini", "anthropic:claude-*"]

[models.openai]
base_url = "http://{net.web}:{PORT}"
key = "env:SAMPLE_OPENAI_KEY"

[models.anthropic]
base_url = "http://{net.web}:{PORT}"
key = "env:SAMPLE_ANTHROPIC_KEY"
""", "model-calls-record.toml")
            out = ROOT / "notebooks" / "samples" / "model-calls.tkb"
            with Box(policy=policy, bundle_path=out) as box:
                box.collect_patch_at_stop = False
                r = box.run(["python3", "-c", AGENT])
                assert r.exit_code == 0, r.stderr.decode()[-2000:]
                print(r.stdout.decode())
            print(f"wrote {out}")
        finally:
            up.stop()


if __name__ == "__main__":
    main()
