// Talking to the dgemma server from the page: the bearer key, error objects as readable messages, and
// server-sent events read from a fetch body (so a Stop can abort the request and close the stream).

const WHAT = {
  400: "the request was refused",
  401: "the API key is missing or wrong",
  404: "not found",
  408: "the request ran past its deadline",
  413: "the request is too large",
  429: "the server is at capacity: retry in a moment",
  503: "the server is loading or shutting down",
};

export class ApiError extends Error {
  constructor(status, message, param = null) {
    super(message);
    this.status = status;
    this.param = param;
  }

  // "429 the server is at capacity: retry in a moment — <the server's message> (field: x)"
  get readable() {
    const head = this.status ? `${this.status} ${WHAT[this.status] || "error"}` : "error";
    const field = this.param ? ` (field: ${this.param})` : "";
    return `${head} — ${this.message}${field}`;
  }
}

async function errorOf(response) {
  let message = response.statusText || "no details", param = null;
  try {
    const body = await response.json();
    message = body.error?.message || message;
    param = body.error?.param || null;
  } catch {
    // not JSON: keep the status text
  }
  return new ApiError(response.status, message, param);
}

export class Client {
  constructor() {
    this.key = "";  // in this page's memory only
  }

  headers(json) {
    const h = {};
    if (this.key) h.Authorization = `Bearer ${this.key}`;
    if (json) h["Content-Type"] = "application/json";
    return h;
  }

  async get(path) {
    const response = await fetch(path, { headers: this.headers(false) });
    if (!response.ok) throw await errorOf(response);
    return response.json();
  }

  // Yields each chunk of a streamed completion; throws ApiError for a refused request or an error chunk.
  async *stream(path, body, signal) {
    const response = await fetch(path, { method: "POST", headers: this.headers(true), body: JSON.stringify(body),
                                          signal });
    if (!response.ok) throw await errorOf(response);
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) throw new ApiError(0, "the connection closed before the answer ended");
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") return;
          const chunk = JSON.parse(data);
          if (chunk.error) {
            const status = { service_unavailable_error: 503, timeout_error: 408 }[chunk.error.type] || 500;
            throw new ApiError(status, chunk.error.message, chunk.error.param);
          }
          yield chunk;
        }
      }
    }
  }
}
