"""Session 66: how many n-gram drafts a real model accepts (the embedded SmolLM2-135M-Instruct, CPU, greedy).

Acceptance depends on the model and the text, not on the device: three chats (editing code, which copies
most of its input; correcting a paragraph; an open story, which copies little), 160 tokens each, for several
speculative configs. Prints per config and task the mean acceptance length (tokens a verify step emits per
request: accepted drafts + 1), the share of drafts accepted, and engine steps per output token.
  python notebooks/spec_acceptance_smollm2.py        # -> stdout (a JSON line per run)
"""
import json

from atlasjax import LLM, SamplingParams

CODE = '''def moving_average(values, window):
    result = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
'''
TASKS = {
    "code_edit": f"Add type hints and a docstring to this Python function. Reply with the whole function.\n\n{CODE}",
    "correct_text": "Correct the spelling mistakes in this paragraph and repeat it in full: The quick brwon fox "
                    "jumpd over the lazy dog. It was a sunny day and the fox was very hapy to be outside in the "
                    "feilds, running between the trees and the flowres.",
    "story": "Write a short story about a lighthouse keeper.",
}
CONFIGS = [None, {"num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
           {"num_speculative_tokens": 4, "prompt_lookup_max": 5, "prompt_lookup_min": 5},
           {"num_speculative_tokens": 8, "prompt_lookup_max": 3, "prompt_lookup_min": 2}]
params = SamplingParams(temperature=0, max_tokens=160)
want = {}
for cfg in CONFIGS:
    llm = LLM(speculative_config=cfg, max_num_seqs=1, max_model_len=1024)
    for name, prompt in TASKS.items():
        s0, steps0 = dict(vars(llm.engine.stats.spec)), llm.engine.stats.num_steps
        s0["accepted_per_pos"] = list(s0["accepted_per_pos"])
        out = llm.chat([{"role": "user", "content": prompt}], params)[0].outputs[0]
        spec = llm.engine.stats.spec
        drafts, tokens = spec.num_drafts - s0["num_drafts"], spec.num_draft_tokens - s0["num_draft_tokens"]
        accepted = spec.num_accepted_tokens - s0["num_accepted_tokens"]
        steps = llm.engine.stats.num_steps - steps0 - 1          # less the prefill
        if cfg is None:
            want[name] = out.token_ids
        print(json.dumps(dict(config=cfg, task=name, output_tokens=len(out.token_ids),
                              same_tokens=out.token_ids == want[name],
                              mean_acceptance_length=round(1 + accepted / drafts, 2) if drafts else None,
                              acceptance_rate=round(accepted / tokens, 3) if tokens else None,
                              steps_with_drafts=drafts, decode_steps=steps,
                              tokens_per_decode_step=round((len(out.token_ids) - 1) / max(steps, 1), 2))), flush=True)
