"""When a sequence stops: SGLang's rules, in SGLang's order, applied after each sampled token.

1. max_new_tokens reached                      -> {"type": "length", "length": max_new_tokens}
2. EOS or a stop_token_id (unless ignore_eos)  -> {"type": "stop", "matched": token id}
3. a stop string in the decoded output         -> {"type": "stop", "matched": the string}
4. the context length reached                  -> {"type": "length", "length": tokens generated}

As in SGLang, ignore_eos also disables stop_token_ids; stop strings still apply. The stopping token stays
in the output ids (trimming the text is the text layer's job, see `no_stop_trim`).
"""

from __future__ import annotations

from clawrl.engine.sequence import Sequence


def stop_reason(seq: Sequence, token: int, *, eos_token_ids: set[int], context_length: int) -> dict | None:
    """Finish reason of `seq` after `token` was appended, or None if it goes on."""
    params = seq.params
    if seq.num_output_tokens >= params.max_new_tokens:
        return {"type": "length", "length": params.max_new_tokens}
    if not params.ignore_eos and (token in params.stop_token_ids or token in eos_token_ids):
        return {"type": "stop", "matched": token}
    if seq.detokenizer is not None:
        # Fed every token (not only when other rules pass) so its text stays complete.
        matched = seq.detokenizer.append(token)
        if matched is not None:
            return {"type": "stop", "matched": matched}
    if seq.num_tokens >= context_length:
        return {"type": "length", "length": seq.num_output_tokens}
    return None
