// The official openai client against a running `moegraph serve`: chat and
// completions, whole and streamed, sampled with a seed; chat's content also as
// an array of text parts; logprobs of a long prompt's completion and of a
// greedy chat. Prints one JSON object per case, {name, text, usage,
// finish_reason, logprobs}, for tests/serve_openai_test.sh to compare with
// `moegraph run` and `moegraph tokenize`.
// Usage: node check.mjs BASE_URL API_KEY LONG_PROMPT_FILE
import { readFileSync } from "node:fs";
import OpenAI from "openai";

const [baseURL, apiKey, longPromptFile] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0 });
const sampling = { temperature: 0.8, top_p: 0.95, seed: 5, max_tokens: 12 };
const messages = [{ role: "user", content: "What is a mixture of experts?" }];
const prompt = "The capital of France is";

async function streamed(create, pick) {
  let text = "", usage = null, finish = null;
  for await (const chunk of await create) {
    text += pick(chunk.choices[0]) ?? "";
    if (chunk.choices[0].finish_reason) finish = chunk.choices[0].finish_reason;
    if (chunk.usage) usage = chunk.usage;
  }
  return { text, usage, finish_reason: finish };
}

const out = [];
const models = await client.models.list();
out.push({ name: "models", text: models.data.map((m) => m.id).join(","), usage: null });

const chat = await client.chat.completions.create({ messages, ...sampling });
out.push({ name: "chat", text: chat.choices[0].message.content, usage: chat.usage,
           finish_reason: chat.choices[0].finish_reason });
out.push({ name: "chat-stream",
           ...(await streamed(client.chat.completions.create({ messages, ...sampling, stream: true }),
                              (c) => c.delta?.content)) });

// The content as an array of text parts, as current clients send it.
const parts = [{ role: "user", content: [{ type: "text", text: "What is a mixture of experts?" }] }];
const chatParts = await client.chat.completions.create({ messages: parts, ...sampling });
out.push({ name: "chat-parts", text: chatParts.choices[0].message.content, usage: chatParts.usage,
           finish_reason: chatParts.choices[0].finish_reason });

const completion = await client.completions.create({ model: "m", prompt, ...sampling });
out.push({ name: "completion", text: completion.choices[0].text, usage: completion.usage,
           finish_reason: completion.choices[0].finish_reason });
out.push({ name: "completion-stream",
           ...(await streamed(client.completions.create({ model: "m", prompt, ...sampling,
                                                          stream: true }),
                              (c) => c.text)) });

// Logprobs: a completion of a long prompt (the body far over 8 KB), and a
// greedy chat with content parts and its top alternatives.
const long = await client.completions.create({
  model: "m", prompt: readFileSync(longPromptFile, "utf8"), max_tokens: 2, temperature: 0,
  logprobs: 2 });
out.push({ name: "logprobs-long", text: long.choices[0].text, usage: long.usage,
           finish_reason: long.choices[0].finish_reason, logprobs: long.choices[0].logprobs });
const greedy = await client.chat.completions.create({
  messages: parts, max_tokens: 6, temperature: 0, logprobs: true, top_logprobs: 2 });
out.push({ name: "logprobs-chat", text: greedy.choices[0].message.content, usage: greedy.usage,
           finish_reason: greedy.choices[0].finish_reason, logprobs: greedy.choices[0].logprobs });

// An error the client raises as an APIError with the server's status.
try {
  await client.chat.completions.create({ messages: [], max_tokens: 4 });
  out.push({ name: "error", text: "no error", usage: null });
} catch (e) {
  out.push({ name: "error", text: `${e.status} ${e.error?.param ?? ""}`, usage: null });
}
for (const o of out) console.log(JSON.stringify(o));
