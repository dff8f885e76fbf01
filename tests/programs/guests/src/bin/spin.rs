//! Loops forever doing arithmetic (fuel, cpu and wall limits must stop it).
fn main() {
    let mut x: u64 = 1;
    loop {
        x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407));
    }
}
