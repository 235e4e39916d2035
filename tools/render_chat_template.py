"""Renders chat templates as transformers does, the oracle of kiln's template rendering
(engine/tests/chat_template.rs). Reads {"template", "bos_token", "eos_token", "cases":
[{"messages", "tools"}]} as JSON on stdin; writes the rendered strings as a JSON list.
Each case ends in the generation prompt (add_generation_prompt=True), as kiln renders them."""
import json
import sys

from transformers.utils.chat_template_utils import render_jinja_template

job = json.load(sys.stdin)
out = []
for case in job["cases"]:
    rendered, _ = render_jinja_template(
        [case["messages"]],
        tools=case.get("tools"),
        chat_template=job["template"],
        add_generation_prompt=True,
        bos_token=job.get("bos_token", ""),
        eos_token=job.get("eos_token", ""),
    )
    out.append(rendered[0])
json.dump(out, sys.stdout)
