// Streams one chat answer from the llmesh gateway's gRPC API, with stubs that
// `make protos` generates into src/gen with protoc-gen-es.
//
//   npm ci && npm run build
//   node dist/chat.js [address] [model] [prompt]     (LLMESH_API_KEY: an API key or JWT)
import { Code, ConnectError, createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import { FinishReason } from "./gen/llmesh/v1/common_pb.js";
import { Gateway } from "./gen/llmesh/v1/gateway_pb.js";

async function main(): Promise<number> {
  const [address = "127.0.0.1:50051", model = "smollm2-135m-instruct", prompt = "Why is the sea salty?"] =
    process.argv.slice(2);
  // gRPC over HTTP/2 without TLS; use https:// for a gateway behind TLS.
  const client = createClient(Gateway, createGrpcTransport({ baseUrl: `http://${address}` }));
  const key = process.env.LLMESH_API_KEY;
  const headers: Record<string, string> = key ? { authorization: `Bearer ${key}` } : {};
  try {
    const stream = client.chat(
      { model, messages: [{ role: "user", content: prompt }], sampling: { maxTokens: 40 } },
      { headers, timeoutMs: 60_000 },
    );
    for await (const chunk of stream) {
      process.stdout.write(chunk.text);
      if (chunk.finishReason !== FinishReason.UNSPECIFIED) {
        const usage = chunk.usage;
        process.stderr.write(`\n[${FinishReason[chunk.finishReason]}; ${usage?.promptTokens} prompt + ` +
          `${usage?.completionTokens} completion tokens]\n`);
      }
    }
    return 0;
  } catch (err) {
    const e = ConnectError.from(err);
    process.stderr.write(`\nchat failed: ${Code[e.code]}: ${e.rawMessage}\n`);
    return 1;
  }
}

process.exitCode = await main();
