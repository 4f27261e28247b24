# The agent of notebooks/03-model-calls.ipynb: one OpenAI chat call and one Anthropic message, through the model door.
import openai
import anthropic
chat = openai.OpenAI().chat.completions.create(
    model="gpt-4o-mini", max_tokens=50, messages=[{"role": "user", "content": "Name one prime number."}])
print("openai:", chat.choices[0].message.content, "| tokens:", chat.usage.total_tokens)
msg = anthropic.Anthropic().messages.create(
    model="claude-3-5-haiku-latest", max_tokens=60, messages=[{"role": "user", "content": "And another one?"}])
print("anthropic:", msg.content[0].text, "| stop:", msg.stop_reason)
