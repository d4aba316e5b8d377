"""Token-level stops, checked after each appended token: EOS (unless ignored), a stop
token id, max_tokens, and the context's end. Stop strings are the detokenizer's."""

from __future__ import annotations

from pagedllm.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Whether the request's last token ends it; sets its status and stop reason."""
    params = request.sampling_params
    last_token_id = request.output_token_ids[-1]
    if not params.ignore_eos and last_token_id in request.eos_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
    elif last_token_id in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last_token_id
    elif request.num_tokens >= max_model_len or (
        params.max_tokens is not None and request.num_output_tokens >= params.max_tokens
    ):
        request.status = RequestStatus.FINISHED_LENGTH
    return request.is_finished
