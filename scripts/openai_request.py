"""One chat request through specdec's OpenAI-compatible API with the official ``openai`` SDK, printed.

The main job (``scripts/main.sh``) runs it after its gRPC demo, against the frontend ``specdec serve`` started; it
is also the smallest complete example of a client that speaks OpenAI's API to specdec (``docs/openai.md``): the
served model's name from ``GET /v1/models``, a system and a user turn, greedy, and the ``specdec`` extension
field that ordinary clients ignore (the SDK keeps it in ``choice.model_extra``).

    python scripts/openai_request.py http://127.0.0.1:8003/v1 [--prompt TEXT] [--max-tokens N] [--method ems]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

import openai


def _model(client: openai.OpenAI, wait_s: float) -> str:
    """The served model's id; the frontend may still be starting, so connection errors are retried for
    ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return client.models.list().data[0].id
        except openai.APIConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base_url", help="the API's base URL, e.g. http://127.0.0.1:8003/v1")
    p.add_argument("--system", default="You are a concise assistant.")
    p.add_argument("--prompt", default="Give me three tips for a good night's sleep.")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--method", default="ems", help="specdec's decoding method (extension field): ems, ar, ...")
    p.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the API to answer at all")
    args = p.parse_args(argv)

    # any key works unless the server requires one (--openai-api-key / $SPECDEC_OPENAI_API_KEY)
    key = os.environ.get("SPECDEC_OPENAI_API_KEY") or "unused"
    client = openai.OpenAI(base_url=args.base_url, api_key=key, max_retries=0)
    model = _model(client, args.wait)
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": args.system}, {"role": "user", "content": args.prompt}],
        max_tokens=args.max_tokens,
        temperature=0,
        extra_body={"method": args.method},
    )
    choice = reply.choices[0]
    print(f"POST {args.base_url}/chat/completions  model={reply.model!r}  user: {args.prompt}")
    print(choice.message.content)
    usage = reply.usage
    counts = f"{usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens" if usage else "no usage"
    print(f"finish_reason={choice.finish_reason}, {counts}")
    extension = (choice.model_extra or {}).get("specdec")
    if extension:
        print(
            f"specdec: method {extension['method']}, {extension['accepted_draft_tokens']} of "
            f"{extension['draft_tokens']} draft tokens accepted, {extension['target_calls']} target calls"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
