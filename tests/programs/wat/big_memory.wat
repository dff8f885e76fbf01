;; Asks for 128 MiB of linear memory at instantiation.
(module
  (memory (export "memory") 2048)
  (func (export "_start")))
