"""``loraplex-openai``: an OpenAI-compatible HTTP gateway in front of Triton's ``lora_llm`` (a Triton client).

It holds no engine state: every request becomes one gRPC stream per prompt to Triton, and the
model list comes from Triton too. It never imports the engine. See docs/openai.md.
"""
