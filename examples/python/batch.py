"""A batch job end to end with the official openai client on llmesh's Batch API: write the
requests as JSONL, upload them (files.create), start a batch (batches.create), wait for it,
and read the answers (files.content) by custom_id. The lines run at the lowest priority,
through the same keys, grants, limits and audit as live requests.

    .venv/bin/python examples/python/batch.py "What is 2+2?" "Name a colour."
    OPENAI_API_KEY=llm_... .venv/bin/python examples/python/batch.py --base-url http://gw:8080/v1 "..."
"""

from __future__ import annotations

import argparse
import io
import json
import os
import time

from openai import OpenAI


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("questions", nargs="+")
    parser.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--wait-s", type=float, default=600)
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"))
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": args.model, "max_tokens": args.max_tokens,
                       "messages": [{"role": "user", "content": question}]}}
             for i, question in enumerate(args.questions)]
    jsonl = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("questions.jsonl", io.BytesIO(jsonl)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"example": "batch.py"})
    deadline = time.monotonic() + args.wait_s
    while batch.status not in ("completed", "failed", "cancelled", "expired") and time.monotonic() < deadline:
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    counts = batch.request_counts
    print(f"batch {batch.id}: {batch.status}, {counts.completed} of {counts.total} completed, {counts.failed} failed")
    answers = {}
    for file_id in (batch.output_file_id, batch.error_file_id):
        for raw in client.files.content(file_id).text.splitlines() if file_id else []:
            result = json.loads(raw)
            body = result["response"]["body"] if result["response"] else {"error": result["error"]}
            answers[result["custom_id"]] = (body["choices"][0]["message"]["content"] if "choices" in body
                                            else f"error: {body['error']}")
    for line, question in zip(lines, args.questions):
        print(f"{question} -> {answers.get(line['custom_id'], '(no result)')}")
    return 0 if batch.status == "completed" and counts.failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
