#[derive(clap::Args)]
pub struct Args {}

pub fn main(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
