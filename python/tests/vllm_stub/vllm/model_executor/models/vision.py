def get_multimodal_config():
    import vllm
    return vllm._config
