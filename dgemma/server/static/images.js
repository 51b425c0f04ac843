// Attaching an image to the next chat message: the file read as a data: URL (sent as an OpenAI image_url part),
// its name shown beside the button, and a thumbnail in the conversation.
const $ = (id) => document.getElementById(id);
let pending = null;  // { url, name } of the attached image, until it is sent or removed

function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

export function bindAttach() {
  $("image").addEventListener("change", async () => {
    const file = $("image").files[0];
    pending = file ? { url: await readAsDataUrl(file), name: file.name } : null;
    $("image-name").textContent = pending ? pending.name : "";
    $("image-remove").hidden = !pending;
  });
  $("image-remove").addEventListener("click", detach);
}

export function detach() {
  pending = null;
  $("image").value = "";
  $("image-name").textContent = "";
  $("image-remove").hidden = true;
}

// The user message's content: the text alone, or the attached image then the text (detached once answered).
export function userContent(text) {
  if (!pending) return text;
  return [{ type: "image_url", image_url: { url: pending.url } }, { type: "text", text }];
}

// The text of a message's content, and its image's data URL if it has one.
export function parts(content) {
  if (typeof content === "string") return { text: content, image: null };
  return { text: content.filter((p) => p.type === "text").map((p) => p.text).join(""),
           image: content.find((p) => p.type === "image_url")?.image_url.url ?? null };
}
