"""ellm inside other frameworks, in-process (no server): each module imports its framework
only when it is imported itself, and nothing in ellm imports this package.

    ellm.integrations.langchain    ChatEllm, EllmEmbeddings          extra [langchain]
    ellm.integrations.llama_index  EllmLLM, EllmEmbedding            extra [llamaindex]
    ellm.integrations.litellm      the "ellm/<model>" provider       extra [litellm]
    ellm.integrations.llm_plugin   the `llm` CLI's plugin            extra [llm]

Each takes a loaded model (`llm=ellm.load(...)`) or a model name (`model=`); names are
loaded once per process through one shared cache (ellm.integrations.shared), so two
integrations asking for the same model get the same LLM. See docs/integrations.md.
"""
