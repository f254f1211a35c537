"""vLLM model-runner hook (work in progress: the engine part of issue 26)."""


def install() -> None:
    raise NotImplementedError("randattn.vllm: the engine hooks are not written yet")
