//! Adds one response header to every response: the smallest filter that
//! does per-request work, as a memory reference for `make bench-memory`.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| Box::new(Root));
}}

struct Root;

impl Context for Root {}

impl RootContext for Root {
    fn create_http_context(&self, _id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Stream;

impl Context for Stream {}

impl HttpContext for Stream {
    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        self.add_http_response_header("x-minimal", "1");
        Action::Continue
    }
}
